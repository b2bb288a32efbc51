"""`python -m aenv.guest`: how the runtime starts the guest agent inside a sandbox.

Every module the agent imports stays in its memory, which every checkpoint saves and every restore
and fork child loads again (about 3 ms per MiB per child for a fork of 16 on two cores). asyncio
imports ssl, and with it OpenSSL: 1.2 MiB the agent never uses (it speaks no TLS; egress through
it is tunnelled bytes). So ssl is marked absent first, which asyncio handles as it does a Python
built without it. Features used rarely (directory watches, the files API's moves) import what
they need when first used.
"""

import os
import sys

sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]

from aenv.guest import preload  # noqa: E402

# <bundle>/pkg/aenv/guest/__main__.py: the start-up imports come from <bundle>/modules.bin if it is there
preload.install(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from aenv.guest.agent import main  # noqa: E402

preload.done()
main()
