"""DeepSeek-V3 671B (37B active), the sizes of HF's deepseek-ai/DeepSeek-V3 config.json: 61
layers, hidden 7168, 128 heads with MLA (q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim
128 + qk_rope_head_dim 64, v_head_dim 128), 256 routed experts top-8 of moe_intermediate_size
2048 + 1 shared, the first 3 layers dense (first_k_dense_replace, intermediate_size 18432),
sigmoid scoring, n_group 8 / topk_group 4, routed_scaling_factor 2.5, norm_topk_prob, vocab
129280, rms_norm_eps 1e-6, rope_theta 1e4 with the released rope_scaling yarn (factor 40,
original_max_position_embeddings 4096, beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1:
the rope part's frequencies interpolated for pairs turning fewer than 32 times in 4096
tokens, the softmax scale times 1.874 = 1.369², cos/sin unscaled; model.mla). The released config's
max_position_embeddings is 163840 (40 x 4096); max_seq_len here is the training sequence,
which HF reads as the same rope. The auxiliary-loss-free bias at rate 1e-3 and
the sequence-wise balance loss at 1e-4 as the technical report (arXiv 2412.19437) trains it.
Multi-token prediction (num_nextn_predict_layers 1, loss factor 0.3 then 0.1) is off here:
jaxtrain runs it only without pipeline stages yet (deepseek_v3_16b runs it); on the pipeline it
will sit on the last stage (last_stage_layers=1 leaves it the room).

train.py refuses this recipe's layout today: the pipeline executor's chunks stack one kind of
layer, and the three dense first layers sit among the MoE ones (config_check says so; the
ledger prices the layout as Megatron runs it and its notes say it is refused). The 16B proxy
(deepseek_v3_16b.py, no pipeline) trains.

Megatron's layout table runs it on 1024 GPUs as TP2 PP16 EP64. TP2 PP16 leaves data 32, so
EP64 needs MoE parallel folding (parallel.expert_tensor=1: 32 expert ranks carved out of data x
the 2 tensor ranks, each expert whole); the ledger says that does not fit dropless either:
16-27% MFU at 81.8 of 72 GiB (its receive buffers hold 64 x top_k rows of the whole expert per
dispatched token). The configured layout is the nearest that does less badly: tensor 2 with sequence
parallelism, stage 16 (15 stages of 4 layers and a last of 1), expert 32, 256 microbatches of
one 4096-token sequence (global batch 8192), ZeRO-1, full recompute, dropless. The ledger
(`python -m jaxtrain.plan --config configs/deepseek_v3.py --devices 1024 --gpu h100`, the
configured row) says it does not fit: 11-19% MFU at 76.3 of 72 GiB, of which 36.4 GiB
activations. The term is the dropless dispatch's static worst case: the executor's shapes are
static, so a rank's expert buffers hold top_k x expert = 256 rows per token where 8 arrive on
average. The 32 stashed chunk inputs take 3.5 GiB; the one layer a backward re-materialises
takes 32.8 GiB, almost all of it the expert rows at that size; the reserve adds the all-to-all's
send and receive buffers, 14.4 GiB of dispatch buffers. With the padded capacity buffers
(model.moe.dispatch=capacity, pad_to_capacity=true: 8 rows per token, tokens past an expert's
even share dropped) the layout fits: 11-19% MFU at 45.0 of 72 GiB. At expert 8 it fits dropless:
11-20% MFU at 57.2 of 72 GiB. Its all-to-all moves 2658.5 GB per device per step over the NIC
(32 expert ranks x tensor 2 span 8 nodes): 53 s of a 8.3 s ideal step, which caps the MFU;
DeepSeek's node-limited routing, which bounds that traffic, is not modelled. The planner's own
pick: tensor 4, stage 16, expert 8 folded, remat full(uniform,1), 29-45% MFU at 64.1 of 72 GiB.
"""
from jaxtrain.config import Config, MlaConfig, ModelConfig, MoeConfig, TrainConfig


def get_config() -> Config:
    cfg = Config(
        model=ModelConfig(
            vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128,
            mlp_size=18432, rope_theta=10000.0, max_seq_len=4096, norm_eps=1e-6,
            compute_dtype="bfloat16",
            mla=MlaConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128, yarn_factor=40.0,
                          yarn_original_max_position=4096, yarn_beta_fast=32.0,
                          yarn_beta_slow=1.0, yarn_mscale=1.0, mscale_all_dim=1.0),
            moe=MoeConfig(num_experts=256, top_k=8, mlp_size=2048, shared_experts=1,
                          first_k_dense=3, score_function="sigmoid", norm_topk_prob=True,
                          routed_scaling_factor=2.5, n_group=8, topk_group=4,
                          expert_bias=True, bias_update_rate=1e-3, aux_loss_coeff=0.0,
                          seq_aux_loss_coeff=1e-4, dispatch="dropless")),
        train=TrainConfig(steps=100_000, global_batch=8192, seq_len=4096, lr=2.2e-4,
                          min_lr_ratio=0.1, warmup_steps=2000, weight_decay=0.1, grad_clip=1.0,
                          workdir="runs/deepseek_v3", log_every=1),
    )
    cfg.parallel.tensor = 2
    cfg.parallel.sequence_parallel = True
    cfg.parallel.stage = 16
    cfg.parallel.expert = 32
    cfg.parallel.data = -1
    cfg.parallel.zero1 = True
    cfg.parallel.microbatches = 256
    cfg.parallel.last_stage_layers = 1
    cfg.remat.granularity = "full"
    return cfg
