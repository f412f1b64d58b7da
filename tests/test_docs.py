"""What the docs say is what the code does: the README's key table lists every config key, and
the numbers the recipes' docstrings and the README quote from the planner are what it prints
(they drifted: the 70B recipe said 59.1 of 72 GiB where the planner printed 58.6)."""
import dataclasses
import pathlib
import re
import typing

import pytest

from jaxtrain.config import Config, load_recipe
from jaxtrain.ledger import GB, GiB, REMAT_VARIANTS, estimate, layout_from_config
from jaxtrain.tools import plan

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _words(text: str) -> str:
    return " ".join(text.split())


def test_the_readme_key_table_lists_every_config_key():
    """A nested section has its name in its parent's row (`rope_scaling.*`) and may have a row
    of its own (`model.moe.`), which then lists its keys."""
    rows = re.findall(r"^\| `([\w.]+)\.` \| (.+) \|$", (ROOT / "README.md").read_text(), re.M)
    table = {section: set(re.sub(r"\([^)]*\)|\.\*", "", keys).split()) for section, keys in rows}
    sections = {}

    def walk(prefix, cls):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = typing.get_args(hints[f.name]) or (hints[f.name],)
            nested = [k for k in kind if dataclasses.is_dataclass(k)]
            if prefix:
                sections.setdefault(prefix, set()).add(f.name)
            name = f"{prefix}.{f.name}".lstrip(".")
            if nested and (not prefix or name in table):
                walk(name, nested[0])
    walk("", Config)
    assert set(table) == set(sections)
    for section, fields in sections.items():
        assert table[section] == fields, (section, sorted(fields ^ table[section]))


def _mfu(e) -> str:
    return f"{e.expected_mfu[0]:.0%}-{e.expected_mfu[1]:.0%}".replace("%-", "-")


def _configured(recipe: str, devices: int, remat: str | None = None):
    cfg = load_recipe(ROOT / "configs" / recipe)
    return estimate(cfg, layout_from_config(cfg, devices), "h100",
                    remat=REMAT_VARIANTS[remat] if remat else None)


def _claims():
    """(recipe, what its docstring must say), each generated from the ledger."""
    e = _configured("llama70b.py", 1024)
    yield "llama70b.py", (f"{_mfu(e)} MFU at {e.total_bytes / GiB:.1f} of "
                          f"{e.budget_bytes / GiB:.0f} GiB, of which "
                          f"{e.activation_bytes / GiB:.1f} GiB are the pipeline's stashed")
    yield "llama70b.py", f"rank 0 holds {e.executor.stash_buffer} chunk-microbatches"
    full = _configured("llama70b.py", 1024, "full")
    yield "llama70b.py", (f"would need {full.activation_bytes / GiB:.1f} GiB of them but runs "
                          f"every layer's forward again ({_mfu(full)})")
    e = _configured("llama405b.py", 1024)
    yield "llama405b.py", (f"rates it {_mfu(e)} MFU at {e.total_bytes / GiB:.1f} of "
                           f"{e.budget_bytes / GiB:.0f} GiB")
    none = _configured("llama405b.py", 1024, "none")
    yield "llama405b.py", f"the stash alone needs {none.activation_bytes / GiB:.0f} GiB"
    e = _configured("llama3_8b_128k.py", 8)
    yield "llama3_8b_128k.py", (f"rates it {_mfu(e)} MFU at {e.total_bytes / GiB:.0f} of "
                                f"{e.budget_bytes / GiB:.0f} GiB per device (micro-batch "
                                f"{e.layout.micro_batch})")
    e = _configured("llama3_8b_128k.py", 16)
    yield "llama3_8b_128k.py", (f"on 16 devices {_mfu(e)} at {e.total_bytes / GiB:.0f} GiB "
                                f"(micro-batch {e.layout.micro_batch};")
    e = _configured("mixtral_8x7b.py", 64)
    L = e.layout
    assert (L.tensor, L.stage, L.expert, e.fits) == (1, 4, 8, True)
    yield "mixtral_8x7b.py", (f"the configured row) {_mfu(e)} MFU at {e.total_bytes / GiB:.1f} of "
                              f"{e.budget_bytes / GiB:.0f} GiB")
    none = _configured("mixtral_8x7b.py", 64, "none")
    assert not none.fits
    yield "mixtral_8x7b.py", f"stash needs {none.total_bytes / GiB:.1f} GiB and does not fit"
    yield "mixtral_8x7b.py", (f"all-to-all moves {e.comm_bytes['ep'] / GB:.1f} GB per device per "
                              f"step over {dict(nvlink='NVLink', nic='the NIC')[e.comm_links['ep']]}")
    pick = plan.plan(load_recipe(ROOT / "configs" / "mixtral_8x7b.py"), 64, "h100").recommended
    L = pick.estimate.layout
    assert pick.estimate.remat == "none"
    yield "mixtral_8x7b.py", (f"tensor {L.tensor}, stage {L.stage} x {L.virtual_stages} virtual, "
                              f"expert {L.expert}, no recompute: {_mfu(pick.estimate)} at "
                              f"{pick.estimate.total_bytes / GiB:.1f} GiB")
    pick = plan.plan(load_recipe(ROOT / "configs" / "llama3_8b_128k.py"), 16, "h100").recommended
    L = pick.estimate.layout
    yield "llama3_8b_128k.py", (f"tensor {L.tensor} x context {L.context} without recompute, "
                                f"rates {_mfu(pick.estimate)}")


@pytest.mark.parametrize("recipe, claim", list(_claims()))
def test_recipe_docstrings_quote_the_planner(recipe, claim):
    text = _words((ROOT / "configs" / recipe).read_text().split('"""')[1])
    assert claim in text


def test_the_readme_quotes_the_planner():
    cfg = load_recipe(ROOT / "configs" / "llama70b.py")
    e = estimate(cfg, plan.explicit_layout(cfg, 1024, tensor=8, stage=4, virtual_stages=4,
                                           micro_batch=1), "h100")
    text = _words((ROOT / "README.md").read_text())
    assert (f"it prints {e.activation_bytes / GiB:.1f} GiB ({e.activation_bytes / GB:.1f} GB) "
            "of activations") in text
