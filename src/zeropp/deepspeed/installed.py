"""Importing this module runs `zeropp.install_as_deepspeed()`.

For places that can only name modules to import, not call a function: the fork
server of `zeropp launch --as-deepspeed` imports it first, so the preloaded
transformers / accelerate / TRL see DeepSpeed (zeropp) when they decide, and every
rank forked from the server starts with it installed. A script's own
`install_as_deepspeed()` call is then a no-op (it is idempotent).
"""

from .alias import install_as_deepspeed

install_as_deepspeed()
