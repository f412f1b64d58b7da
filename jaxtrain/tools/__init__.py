"""The tools room: the planner, dry run, remat sweep, HLO readers, the GPU program report,
profile readers and the MFU breakdown, Hugging Face import/export. The training path never
imports them (tests/test_layering.py)."""
