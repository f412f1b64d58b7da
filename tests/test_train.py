"""End to end: the trainer on the embedded corpus, checkpoints, resume, bad input."""
import json
import shutil

import jax
import numpy as np
import pytest

from jaxtrain import trainer
from jaxtrain.tools import hf
from jaxtrain.checkpoint import CheckpointMismatchError, read_layer_order, read_saved_params
from jaxtrain.config import ConfigError, derive
from util import logged_losses, metric_records, tiny_config


def test_loss_falls_on_the_corpus_and_metrics_are_written(tmp_path):
    cfg = tiny_config("--train.steps=40", "--train.lr=1e-2", "--train.log_every=1",
                      "--train.eval_every=20", "--train.eval_batches=1", workdir=str(tmp_path))
    final = trainer.train(cfg)
    losses = logged_losses(tmp_path)
    # Bytes start near uniform (ln 259 = 5.6) and the model quickly learns byte statistics
    # and more.
    first, last = losses[1], sum(losses[s] for s in range(36, 41)) / 5
    assert last < first - 2.0 and last < 2.6, losses
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The first step is timed with compilation: logged with its own time, not as throughput.
    assert records[0]["step"] == 1 and records[0]["first_step_time_s"] > 0
    assert "tokens_per_sec" not in records[0] and "mfu" not in records[0]
    record = records[1]
    for key in ("step", "loss", "tokens_per_sec", "tokens_per_sec_per_device", "step_time_s",
                "mfu", "hfu", "grad_norm", "lr"):
        assert key in record
    assert 0 < record["mfu"] < 1 and record["hfu"] >= record["mfu"]
    assert "eval_loss" in final
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 40
    assert "git_commit" in json.loads((tmp_path / "run.json").read_text())
    assert list((tmp_path / "tensorboard").iterdir())


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    common = ("--train.steps=6", "--checkpoint.every=100", "--checkpoint.async_save=false")
    straight = tiny_config(*common, workdir=str(tmp_path / "a"))
    trainer.train(straight)
    stopped = tiny_config(*common, "--train.exit_interval=3", workdir=str(tmp_path / "b"))
    trainer.train(stopped)  # exits after step 3 with a checkpoint
    assert max(logged_losses(tmp_path / "b")) == 3
    trainer.train(stopped)  # resumes at 3, runs to 6
    # Every step is logged, the first after the restart (step 4) too.
    a, b = logged_losses(tmp_path / "a"), logged_losses(tmp_path / "b")
    assert sorted(b) == sorted(a) == [1, 2, 3, 4, 5, 6]
    assert [a[s] for s in b] == [b[s] for s in b]  # bit-exact


@pytest.mark.slow
def test_pipelined_checkpoint_resumes_unpipelined_and_exports_in_model_order(tmp_path):
    """Interleaved chunks store layers in chunk order (0, 2, 1, 3 here); the checkpoint records
    it, so a run under another layout restores it converted, and export reads model order."""
    common = ("--model.num_layers=4", "--train.steps=4", "--checkpoint.every=2",
              "--checkpoint.async_save=false")
    piped = ("--parallel.stage=2", "--parallel.virtual_stages=2", "--parallel.microbatches=2",
             "--parallel.schedule=interleaved_1f1b", "--parallel.data=-1")
    a, b = tmp_path / "a", tmp_path / "b"
    trainer.train(tiny_config(*common, *piped, workdir=str(a)))
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "4")
    trainer.train(tiny_config(*common, "--parallel.data=-1", workdir=str(b)))  # from step 2
    # same weights at step 2, steps 3 and 4 in another layout: equal up to f32 summation order
    assert logged_losses(b)[4] == pytest.approx(logged_losses(a)[4], rel=1e-4)

    step_dir = a / "checkpoints" / "2"
    order = read_layer_order(step_dir, 4)
    assert order.rows == (0, 2, 1, 3)
    stored = read_saved_params(step_dir)["blocks"]["attn"]["wq"]["kernel"]
    exported, _ = hf.read_checkpoint(a, step=2)
    np.testing.assert_array_equal(exported["blocks"]["attn"]["wq"]["kernel"],
                                  stored[[0, 2, 1, 3]])


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = tiny_config("--train.steps=4", "--checkpoint.async_save=false", workdir=str(tmp_path))
    trainer.train(cfg)
    diverging = derive(cfg, "train.steps=8", "train.lr=1e30", "train.grad_clip=0",
                       "train.warmup_steps=0")
    with pytest.raises(trainer.NonFiniteLossError, match="last good checkpoint is kept"):
        trainer.train(diverging)
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                  if p.name.isdigit()) == [4]


def test_starting_over_on_existing_checkpoints_is_refused_before_compiling(tmp_path, monkeypatch):
    trainer.train(tiny_config("--train.steps=2", workdir=str(tmp_path)))
    monkeypatch.setattr(trainer.setup_lib, "build", lambda *a: pytest.fail("compiled"))
    again = tiny_config("--train.steps=2", "--checkpoint.resume=false", workdir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"resume=false starts over.*steps 2\).*fresh folder"):
        trainer.train(again)
    assert (tmp_path / "checkpoints" / "2").is_dir()


def test_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    trainer.train(tiny_config("--train.steps=1", workdir=str(tmp_path)))
    wider = tiny_config("--train.steps=2", "--model.mlp_size=192", workdir=str(tmp_path))
    with pytest.raises(CheckpointMismatchError, match=r"w_down/kernel.*\(2, 128, 64\).*dim 1 is "
                       r"128 in the checkpoint and 192 now \(model.mlp_size=192\)"):
        trainer.train(wider)


def test_pipeline_schedule_summary_printed_at_start():
    cfg = tiny_config("--parallel.stage=2", "--parallel.microbatches=4",
                      "--parallel.schedule=interleaved_1f1b", "--parallel.virtual_stages=2",
                      "--model.num_layers=6", "--parallel.first_stage_layers=2")
    text = trainer.pipeline_summary(cfg, 2)
    assert "bubble (p-1)/(m·v) = 12.5%" in text and "at most (4, 2)" in text
    assert "layers per stage (2, 4)" in text


def test_a_checkpoint_resumes_under_another_tensor_degree(tmp_path):
    """The vocab tables are padded to 128·tensor (384 rows at tensor 1, 512 at 2): a checkpoint
    written at one degree is re-padded on restore at another (both directions), and the run
    equals the uninterrupted one; a real vocab change is named as such."""
    common = ("--train.steps=3", "--train.exit_interval=1", "--checkpoint.async_save=false")
    logged = []
    for tensor in (1, 2, 1):  # steps 1, 2, 3, each under its own degree
        trainer.train(tiny_config(*common, f"--parallel.tensor={tensor}",
                                  workdir=str(tmp_path / "b")), log=logged.append)
    assert sum("layout tensor=2 " in line for line in logged) == 1, logged
    trainer.train(tiny_config("--train.steps=3", workdir=str(tmp_path / "a")))
    a, b = logged_losses(tmp_path / "a"), logged_losses(tmp_path / "b")
    assert sorted(b) == [1, 2, 3] and [b[s] for s in a] == pytest.approx(list(a.values()),
                                                                        rel=1e-6)
    larger = tiny_config("--train.steps=4", "--model.vocab_size=500", workdir=str(tmp_path / "b"))
    with pytest.raises(CheckpointMismatchError, match=r"params/embed has shape \(384, 64\) .*"
                       r"its vocab dim holds 384 rows, fewer than model.vocab_size=500"):
        trainer.train(larger)


def test_a_checkpoint_resumes_across_the_stage_split_vocab_state(tmp_path):
    """Under stages the vocab tables' masters and Adam moments are split over `stage` (issue
    31); without stages they are whole. A checkpoint of either restores under the other (the
    state is stored as global arrays and placed on the restoring layout's shardings): steps 1,
    2, 3 under stage 1, 2, 1 equal the uninterrupted unpipelined run, with tied tables too."""
    for tied in ("false", "true"):
        common = ("--train.steps=3", "--train.exit_interval=1", "--checkpoint.async_save=false",
                  "--model.num_layers=4", "--parallel.data=-1", "--parallel.microbatches=2",
                  "--train.global_batch=16",
                  f"--model.tie_embeddings={tied}")
        b, a = tmp_path / f"b{tied}", tmp_path / f"a{tied}"
        for stage in (1, 2, 1):
            trainer.train(tiny_config(*common, f"--parallel.stage={stage}", workdir=str(b)))
        trainer.train(tiny_config(*common[:1], *common[2:], workdir=str(a)))
        got, want = logged_losses(b), logged_losses(a)
        assert sorted(got) == [1, 2, 3]
        assert [got[s] for s in want] == pytest.approx(list(want.values()), rel=1e-5)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 4-step run (warmup 2, cosine to 0.1 x lr at step 4) and what it logged."""
    workdir = tmp_path_factory.mktemp("finished")
    logged = []
    trainer.train(tiny_config("--train.steps=4", "--checkpoint.async_save=false",
                              workdir=str(workdir)), log=logged.append)
    return workdir, logged


def test_a_run_prints_a_header_and_a_closing_line(finished):
    workdir, logged = finished
    params = read_saved_params(workdir / "checkpoints" / "4")  # vocab 384: no padding here
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert logged[0] == (f"jaxtrain: {count:,} parameters (123.20 K) on 8 x cpu; layout "
                         "tensor=1 stage=1 data=8 micro_batch=1 x 1 microbatches; 256 tokens per "
                         "step (8 sequences x 32); from step 0 to train.steps=4")
    loss = logged_losses(workdir)[4]
    assert logged[-1].startswith(f"finished at step 4: loss {loss:.4f}; last checkpoint "
                                 f"{workdir}/checkpoints/4; wall time "), logged


def test_a_run_past_its_steps_says_so(finished, tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    shutil.copytree(finished[0], workdir)
    logged = []
    assert trainer.train(tiny_config("--train.steps=4", workdir=str(workdir)),
                         log=logged.append) == {}
    assert logged[-1] == (f"{workdir} is already at step 4 = train.steps: nothing to train. "
                          "Raise train.steps to train on (train.lr_decay_steps keeps the decay "
                          "where it was) or set train.workdir to a fresh folder")
    monkeypatch.setattr(trainer.setup_lib, "build", lambda *a: pytest.fail("built"))
    with pytest.raises(ConfigError, match=r"train.steps=2, but .*/checkpoints already holds "
                       r"checkpoint 4: nothing to train. Set train.workdir to a fresh folder"):
        trainer.train(tiny_config("--train.steps=2", workdir=str(workdir)))
    with pytest.raises(ConfigError, match=r"profile_steps=2 ends after train.steps=4"):
        tiny_config("--train.steps=4", "--train.profile_start=3", "--train.profile_steps=2")


def test_extending_a_finished_run_keeps_its_decay_with_lr_decay_steps(finished, tmp_path,
                                                                       capsys):
    """Megatron's --lr-decay-iters: train.lr_decay_steps=4 keeps a 4-step run's floor when it
    is extended to 6 (the same run as one that went to 6 with that horizon from the start);
    extended without it, the schedule stretches and the resume says so."""
    floor = 3e-3 * 0.1
    kept, stretched, straight = tmp_path / "kept", tmp_path / "stretched", tmp_path / "straight"
    for path in (kept, stretched):
        shutil.copytree(finished[0], path)
    logged = []
    trainer.train(tiny_config("--train.steps=6", "--train.lr_decay_steps=4",
                              "--train.profile_start=1", "--train.profile_steps=1",
                              workdir=str(kept)), log=logged.append)
    assert not any("learning-rate schedule" in line for line in logged), logged
    assert "note: train.profile_start=1 lies before step 4, where this run resumes: nothing " \
        "is profiled" in capsys.readouterr().out and not (kept / "profile").exists()
    trainer.train(tiny_config("--train.steps=6", "--train.lr_decay_steps=4",
                              workdir=str(straight)))
    lrs = {r["step"]: r["lr"] for r in metric_records(kept) if "lr" in r}
    assert lrs[5] == lrs[6] == pytest.approx(floor, rel=1e-6)
    assert logged_losses(kept) == logged_losses(straight)  # bit-exact

    logged = []
    trainer.train(tiny_config("--train.steps=6", workdir=str(stretched)), log=logged.append)
    note = [line for line in logged if "learning-rate schedule" in line]
    assert note == [f"note: the learning-rate schedule differs from the one checkpoint 4 was "
                    f"trained under: decay horizon 4 -> 6 steps (train.steps); step 5 gets lr "
                    f"{[r['lr'] for r in metric_records(stretched) if r['step'] == 5][0]:.3e} "
                    f"(the old schedule: {floor:.3e}); to keep the checkpoint's decay set "
                    "train.lr_decay_steps=4"], logged
