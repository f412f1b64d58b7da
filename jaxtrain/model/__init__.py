"""The model room: the mesh-free Llama (llama.py), its projections (projections.py), the loss
as sums (loss.py), its attention cores (attention.py), FP8 (fp8.py: the converter; fp8_matmul.py:
the matmul) and the Pallas kernels (kernels/). Nothing here imports parallel/, ledger/ or
tools/ (tests/test_layering.py): meshes and shardings come in as injected ops."""
