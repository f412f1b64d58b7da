"""`python -m jaxtrain.hf`: the command line of jaxtrain/tools/hf.py."""
import sys

from jaxtrain.tools.hf import main

if __name__ == "__main__":
    sys.exit(main())
