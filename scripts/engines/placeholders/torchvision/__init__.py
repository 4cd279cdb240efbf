"""A placeholder for torchvision in the SGLang plugin's CPU test environment, never installed.

SGLang's attention modules import its multimodal configs, which import ``torchvision.transforms``
at module level. The only torchvision wheel for torch 2.13 on this machine's registry is a CUDA
build (its ``_C`` needs libtorch_cuda.so), and it does not import beside the CPU torch. So
``scripts/engines/test-cpu.sh sglang`` puts this folder on ``PYTHONPATH``: imports succeed and
any use of a torchvision name raises. The tests exercise text-only attention, which uses none.
"""

from ._absent import absent

__version__ = "0.0.0+placeholder"
__getattr__ = absent(__name__)
