"""`python -m jaxtrain.mfu_breakdown`: the command line of jaxtrain/tools/mfu_breakdown.py."""
import sys

from jaxtrain.tools.mfu_breakdown import main

if __name__ == "__main__":
    sys.exit(main())
