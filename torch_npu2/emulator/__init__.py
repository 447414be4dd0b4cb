"""The emulated NPU2 driver: pyxrt's interface over host memory, executing Programs with NPU numerics."""
from .driver import ARTIFACT_FORMAT, EmulatedXrt, write_artifact

__all__ = ["EmulatedXrt", "write_artifact", "ARTIFACT_FORMAT"]
