MODEL = ["--model.num_layers=8", "--train.seq_len=4096", "--model.attention=auto"]
FSDP8 = ["--parallel.data=1", "--parallel.fsdp=8", "--parallel.tensor=1",
         "--parallel.sequence_parallel=false", "--parallel.zero1=false",
         "--parallel.microbatches=1", "--train.global_batch=8"]
LAYOUTS = {
    "fsdp8_uniform1": FSDP8 + ["--remat.granularity=full", "--remat.method=uniform",
                               "--remat.num_layers=1"],
    "fsdp8_block": FSDP8 + ["--remat.granularity=full", "--remat.method=block",
                            "--remat.num_layers=8"],
    "fsdp8_none": FSDP8 + ["--remat.granularity=none"],
    "tp8_sp": ["--parallel.data=1", "--parallel.fsdp=1", "--parallel.tensor=8",
               "--parallel.sequence_parallel=true", "--parallel.zero1=false",
               "--parallel.microbatches=1", "--train.global_batch=1",
               "--remat.granularity=none"],
}


