import sys

from nmdeploy.cli import main

sys.exit(main())
