"""The model room: the mesh-free Llama (llama.py), its attention cores (attention.py), FP8
matmuls (fp8.py) and the Pallas kernels (kernels/). Nothing here imports parallel/, ledger/
or tools/ (tests/test_layering.py): meshes and shardings come in as injected ops."""
