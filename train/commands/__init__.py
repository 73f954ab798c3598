"""The trainer's command handlers, one module per command. The parsers (train/cli/)
name a handler as "module:function", imported when its command runs: so these
modules import at the top, and `python -m train --help` loads none of them."""
