"""A ~16B DeepSeek-V3 proxy (2.4B active) for 8-64 GPUs: DeepSeek-V2-Lite's sizes (HF
deepseek-ai/DeepSeek-V2-Lite config.json: 27 layers, hidden 2048, 16 heads with MLA without
the q low-rank path, kv_lora_rank 512, heads of 128 + 64 RoPE dims and v 128, 64 routed experts
top-6 of 1408 + 2 shared, the first layer dense of 10944, vocab 102400) with DeepSeek-V3's
router (Moonlight-16B-A3B's choice too): sigmoid scores, group-limited over 8 groups (a token's
experts from its best 4), routed_scaling_factor 2.5, the auxiliary-loss-free bias at 1e-3 and
the sequence-wise loss at 1e-4. Plain RoPE (no YaRN: DeepSeek-V3 pretrained at 4K without it and
extended the context after). Multi-token prediction as DeepSeek-V3's: one module, its loss
factor 0.3, then 0.1 for the last third of the steps (DeepSeek-V3: after 10T of 14.8T tokens).

On 16 H100s: tensor 1, expert 8 carved out of data 16, ZeRO-1, 32 microbatches of one 4096-token
sequence (global batch 512), Megatron's `moe` recompute with core_attn. The ledger (`python -m
jaxtrain.plan --config configs/deepseek_v3_16b.py --devices 16 --gpu h100`, the configured row)
rates it 35-52% MFU at 48.3 of 72 GiB (multi-token prediction included); its all-to-all moves 439.7 GB per device per step over NVLink. The planner's own pick on 16:
tensor 4, stage 1, expert 1, remat none, 38-62% MFU at 59.3 of 72 GiB.
"""
import dataclasses

from jaxtrain.config import Config, MlaConfig, MtpConfig, ParallelConfig, RematConfig

from . import deepseek_v3


def get_config() -> Config:
    cfg = deepseek_v3.get_config()   # its router, balancing, optimizer and data path
    m = cfg.model
    cfg.model = dataclasses.replace(
        m, vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16, num_kv_heads=16,
        mlp_size=10944,
        mla=MlaConfig(q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128),   # plain RoPE: no YaRN
        moe=dataclasses.replace(m.moe, num_experts=64, top_k=6, mlp_size=1408,
                                shared_experts=2, first_k_dense=1),
        mtp=MtpConfig(num_layers=1, loss_scaling_factor=0.3,
                      schedule=f"{cfg.train.steps * 2 // 3}:0.1"))
    cfg.train = dataclasses.replace(cfg.train, global_batch=512, lr=4.2e-4,
                                    workdir="runs/deepseek_v3_16b")
    cfg.parallel = ParallelConfig(tensor=1, stage=1, expert=8, data=-1, zero1=True,
                                  microbatches=32)
    cfg.remat = RematConfig(granularity="selective", modules=("core_attn", "moe"))
    return cfg
