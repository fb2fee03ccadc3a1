"""``python -m tangram_launch.launch [torchrun args] [tangram args] script [script args]``: the launcher."""
import sys

from tangram_launch.launch.torchrun import main

sys.exit(main())
