"""dsv4batch: offline batch scoring for DeepSeek-V4 on Ray Data.

Importing the package is cheap: torch, transformers and ray are imported lazily by the
submodules that need them (`dsv4batch.model`, `dsv4batch.pipeline`, ...).
"""

__version__ = "0.1.0"
