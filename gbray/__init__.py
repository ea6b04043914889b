"""gbray: nightly LoRA rounds that teach a small chat model a browser agent's next tool call.

Importing any gbray module first applies the per-OS fix that must precede `import torch`
(SPEC §10), so the driver, the trainer and every examiner get it before torch loads.
"""

from gbray.platform import prepare_torch_import

prepare_torch_import()
