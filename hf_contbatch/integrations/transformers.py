"""``hf_contbatch.frontends.integrations.transformers`` under its former name."""

import sys

from ..frontends.integrations import transformers as _module

sys.modules[__name__] = _module
