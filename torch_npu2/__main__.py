"""``python -m torch_npu2``: the torch-npu2 command."""
import sys

from .cli import main

sys.exit(main())
