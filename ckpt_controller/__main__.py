"""``python -m ckpt_controller`` is ``ckptctl``."""

import sys

from ckpt_controller.cli import entry

sys.exit(entry())
