"""Test and development utilities: run a real SGLang server on a machine without a GPU.

Nothing here is imported by the plugin, and nothing here belongs in a production server.

* :mod:`xshare_sglang.testing.cpu_server` - ``python -m xshare_sglang.testing.cpu_server ARGS...``
  starts SGLang's own ``sglang.launch_server`` on the CPU engine (``--device cpu`` and friends added
  unless given), by default on the tiny MoE model shipped with the package.
* ``standin/sgl_kernel`` - the small stand-in for SGLang's CUDA-only ``sgl_kernel`` package that
  makes the CPU engine importable (see its docstring for what it provides and what it refuses).
"""

from .cpu_server import CPU_DEFAULTS, cpu_server_command, cpu_server_env, standin_path

__all__ = ["CPU_DEFAULTS", "cpu_server_command", "cpu_server_env", "standin_path"]
