"""The DeepSeek-V3 recipes: all three validate, tiny_deepseek trains through train.py with
falling loss, and the planner numbers the 671B and 16B recipes' docstrings quote are what the
ledger prints (generated here, as test_docs.py does for the Llama and Mixtral recipes)."""
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxtrain.config import load_recipe
from jaxtrain.ledger import GB, GiB, LayoutError, estimate, layout_from_config
from jaxtrain.ledger import experts, memory
from jaxtrain.tools import plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPES = ("tiny_deepseek", "deepseek_v3_16b", "deepseek_v3")


def _recipe(name):
    return load_recipe(ROOT / "configs" / f"{name}.py")


def _mfu(e) -> str:
    return f"{e.expected_mfu[0]:.0%}-{e.expected_mfu[1]:.0%}".replace("%-", "-")


def _mem(e) -> str:
    return f"{_mfu(e)} MFU at {e.total_bytes / GiB:.1f} of {e.budget_bytes / GiB:.0f} GiB"


def _a2a(e) -> str:
    return (f"{e.comm_bytes['ep'] / GB:.1f} GB per device per step over "
            f"{dict(nvlink='NVLink', nic='the NIC')[e.comm_links['ep']]}")


def _pick(cfg, devices) -> str:
    e = plan.plan(cfg, devices, "h100").recommended.estimate
    L = e.layout
    return (f"tensor {L.tensor}, stage {L.stage}, expert {L.expert}"
            f"{' folded' if L.folded else ''}, remat {e.remat}, {_mem(e)}")


@pytest.mark.parametrize("name", RECIPES)
def test_every_deepseek_recipe_validates(name):
    cfg = _recipe(name).validate()
    m = cfg.model
    assert m.mla is not None and m.moe.score_function == "sigmoid" and m.moe.expert_bias
    assert m.moe_layers == tuple(i >= m.moe.first_k_dense for i in range(m.num_layers))
    assert m.moe.shared_experts >= 1 and m.moe.n_group > 1


def test_deepseek_v3_has_the_published_size():
    """671B parameters (HF's safetensors without the MTP module: 671.0B)."""
    e = estimate(_recipe("deepseek_v3"), layout_from_config(_recipe("deepseek_v3"), 1024), "h100")
    assert 670e9 < e.params_total < 672e9, e.params_total


def _claims():
    """(recipe, what its docstring must say), each generated from the ledger."""
    cfg = _recipe("deepseek_v3")
    L = layout_from_config(cfg, 1024)
    assert (L.tensor, L.stage, L.expert, L.data) == (2, 16, 32, 32)
    e = estimate(cfg, L, "h100")
    assert not e.fits   # the worst-case receive buffer; the docstring says so
    yield "deepseek_v3", f"{_mem(e)}, of which {e.activation_bytes / GiB:.1f} GiB activations"
    assert e.overflow == "activations" and L.expert * cfg.model.moe.top_k == 256
    stored, working = memory.chunk_residual_bytes(cfg, L, cfg.remat, e.flash, cfg.train.seq_len,
                                                  e.executor.chunk_layers)
    yield "deepseek_v3", (f"{e.executor.stash_buffer + 2} stashed chunk inputs take "
                          f"{(e.executor.stash_buffer + 2) * stored / GiB:.1f} GiB; the one layer a "
                          f"backward re-materialises takes {working / GiB:.1f} GiB")
    buf = experts.dispatch_buffer_bytes(cfg, L, cfg.train.seq_len)
    yield "deepseek_v3", f"{buf / GiB:.1f} GiB of dispatch buffers"
    padded = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=dataclasses.replace(
        cfg.model.moe, dispatch="capacity", pad_to_capacity=True)))
    ep = estimate(padded, layout_from_config(padded, 1024), "h100")
    assert ep.fits
    yield "deepseek_v3", _mem(ep)
    e8 = estimate(cfg, plan.explicit_layout(cfg, 1024, expert=8), "h100")
    assert e8.fits
    yield "deepseek_v3", _mem(e8)
    yield "deepseek_v3", _a2a(e)
    yield "deepseek_v3", (f"{e.comm_seconds['ep']:.0f} s of a {e.ideal_step_s:.1f} s ideal step")
    yield "deepseek_v3", _pick(cfg, 1024)
    cfg = _recipe("deepseek_v3_16b")
    e = estimate(cfg, layout_from_config(cfg, 16), "h100")
    assert e.fits and (e.layout.tensor, e.layout.expert) == (1, 8)
    yield "deepseek_v3_16b", _mem(e)
    yield "deepseek_v3_16b", _a2a(e)
    yield "deepseek_v3_16b", _pick(cfg, 16)


@pytest.mark.parametrize("recipe, claim", list(_claims()))
def test_deepseek_docstrings_quote_the_planner(recipe, claim):
    text = " ".join((ROOT / "configs" / f"{recipe}.py").read_text().split('"""')[1].split())
    assert claim in text


def test_megatrons_ep64_layout_needs_folding_and_overflows_dropless():
    """TP2 PP16 on 1024 leaves data 32: EP64 out of data alone is refused, naming folding;
    folded over the tensor ranks it is priced, and its dropless buffers overflow."""
    cfg = _recipe("deepseek_v3")
    with pytest.raises(LayoutError, match=r"^expert=64 does not divide data=32 .*"
                                          r"fold the 2 tensor ranks in \(expert_tensor=1\)"):
        estimate(cfg, plan.explicit_layout(cfg, 1024, expert=64), "h100")
    e = estimate(cfg, plan.explicit_layout(cfg, 1024, expert=64, expert_tensor=1), "h100")
    assert e.layout.folded and not e.fits and e.overflow == "activations"
    assert _mem(e) in " ".join((ROOT / "configs/deepseek_v3.py").read_text().split())


def test_a_layout_its_dropless_buffers_overflow_is_told_to_shrink_them():
    """The 671B's configured layout overflows under full recompute: the ledger's advice names
    the expert buffers (top_k x expert rows per token) and the capacity dispatch, never more
    recompute; with capacity-sized buffers the same layout fits."""
    cfg = _recipe("deepseek_v3")
    e = estimate(cfg, layout_from_config(cfg, 1024), "h100")
    assert not e.fits and "more recompute" not in e.reason
    assert "pad_to_capacity=true" in e.reason and "256 rows per token" in e.reason
    capped = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=dataclasses.replace(
        cfg.model.moe, dispatch="capacity", pad_to_capacity=True)))
    assert estimate(capped, layout_from_config(capped, 1024), "h100").fits


def test_tiny_deepseek_trains_through_train_py(tmp_path):
    """Ten steps of the recipe through train.py on one CPU device: the loss falls well below
    its start; the MoE line reports the balance statistics."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", "configs/tiny_deepseek.py",
         "--train.steps=10", "--train.log_every=1", "--train.eval_every=0",
         "--train.global_batch=8", f"--train.workdir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    losses = [float(x) for x in re.findall(r"step +\d+ \| loss ([\d.]+)", out)]
    print("tiny_deepseek losses:", losses)
    assert len(losses) == 10 and losses[-1] < 0.7 * losses[0], losses
    assert "moe aux" in out
