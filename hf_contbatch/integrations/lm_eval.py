"""``hf_contbatch.frontends.integrations.lm_eval`` under its former name (importing it registers the lm-eval model type)."""

import sys

from ..frontends.integrations import lm_eval as _module

sys.modules[__name__] = _module
