import sys

from nmdeploy.cli import console_main

sys.exit(console_main())
