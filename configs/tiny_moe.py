"""The CPU MoE recipe: the tiny byte-level Llama with every MLP a mixture of 4 experts, top-2
(Mixtral's router, the aux-loss coefficient Megatron's examples use), dropless.

Its model trains on a CPU with falling loss (tests/test_recipes_moe.py drives the model
directly); `train.py` refuses model.moe until the executors' expert dispatch lands (then
`--parallel.expert=2` on 8 fake devices is its expert-parallel run).
"""
import dataclasses

from jaxtrain.config import MoeConfig

from . import tiny


def get_config():
    cfg = tiny.get_config()
    moe = MoeConfig(num_experts=4, top_k=2, mlp_size=192, aux_loss_coeff=1e-2)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe))
    cfg.train.workdir = "runs/tiny_moe"
    return cfg
