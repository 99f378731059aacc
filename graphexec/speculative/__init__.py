"""Speculative decoding: draft verification inside the captured step, and the drafters.

`verify_drafts` / `verify_step` (verify.py) check K drafts per row against the target's
logits; `SpeculativeConfig` (spec_config.py) turns speculation on in the executor;
drafters propose the drafts: prompt lookup (ngram.py) on the host, or a draft model run
inside the step (`engine/step.py`); `engine/drafts.py` is the executor's host side.
"""

from graphexec.speculative.spec_config import SpeculativeConfig
from graphexec.speculative.verify import VerifyOutput, verify_drafts, verify_step

__all__ = ["SpeculativeConfig", "VerifyOutput", "verify_drafts", "verify_step"]
