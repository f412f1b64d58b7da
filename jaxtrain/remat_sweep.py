"""`python -m jaxtrain.remat_sweep`: the command line of jaxtrain/tools/remat_sweep.py."""
import sys

from jaxtrain.tools.remat_sweep import main

if __name__ == "__main__":
    sys.exit(main())
