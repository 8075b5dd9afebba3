"""Structured outputs inside the continuous batch: JSON schema, regex, choice and EBNF grammars.

``specs`` checks a request's ``structured_outputs`` at submit and parses its grammar; ``compiler``
compiles grammars against the engine's tokenizer in a worker thread, cached; ``matchers`` holds
one matcher per request and masks a step's constrained rows with one bitmask; ``mask_slot`` marks
where in a request's processor list the mask applies. The grammar library is xgrammar (the
optional extra ``structured``), imported only when a request asks for a grammar.
"""

from .compiler import GrammarCompilation
from .mask_slot import GrammarMaskSlot, split_at_mask_slot
from .matchers import GrammarMatchers, GrammarViolation
from .specs import GrammarSpec, as_structured_outputs_params, spec_of

__all__ = [
    "GrammarCompilation",
    "GrammarMaskSlot",
    "GrammarMatchers",
    "GrammarSpec",
    "GrammarViolation",
    "as_structured_outputs_params",
    "spec_of",
    "split_at_mask_slot",
]
