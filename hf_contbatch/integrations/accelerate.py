"""``hf_contbatch.frontends.integrations.accelerate`` under its former name."""

import sys

from ..frontends.integrations import accelerate as _module

sys.modules[__name__] = _module
