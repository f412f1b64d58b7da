"""The CPU MoE recipe: the tiny byte-level Llama with every MLP a mixture of 4 experts, top-2
(Mixtral's router, the aux-loss coefficient Megatron's examples use), dropless.

Its model trains on a CPU with falling loss (tests/test_recipes_moe.py); `python train.py
--config configs/tiny_moe.py` trains it on one device, and with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` and `--parallel.expert=2` its experts
split over expert ranks carved out of the 8 data-parallel ones (tests/test_expert_parallel.py).
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
