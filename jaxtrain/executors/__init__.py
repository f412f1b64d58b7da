"""The executors' room: how one global batch becomes (loss, gradients, FP8 observations).

    setup.py     the model on a mesh (Setup: the model built once, its ops, bind, where the
                 state lives) and the microbatch split both executors use
    contract.py  what both executors return (Sums) and the step's one normalisation
    replica.py   stage = 1: each data (and context) replica scans its microbatches
                 (`microbatched`, levanter's gradient-accumulation shape), then one
                 data-parallel reduction
    pipeline.py  stage > 1: the Llama on the pipeline executor (parallel/pipeline.py)

Neither executor imports the other; jaxtrain/step.py picks one and wraps it in the jitted
steps. tests/test_layering.py holds the arrows.
"""
