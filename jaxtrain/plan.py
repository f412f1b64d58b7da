"""`python -m jaxtrain.plan`: the command line of jaxtrain/tools/plan.py."""
import sys

from jaxtrain.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
