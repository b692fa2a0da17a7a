"""TraCT's vLLM general plugin: entry point `tract_amx` of the group
`vllm.general_plugins`, which vLLM calls at start in each of its processes (its
front end, its engine core, its workers) of an environment where TraCT is
installed; `VLLM_PLUGINS` selects which plugins vLLM loads.

It asks Linux for the AMX tile state on a CPU that has AMX.  vLLM 0.32's CPU
attention runs AMX instructions for bf16 without asking (its matrix products
ask, through oneDNN, the first time they use AMX, and a prompt computed whole
reaches them first); a decode instance whose first step attends over KV it
loaded, computing a single token, runs the attention before any product has
asked, and dies of an illegal instruction.  TraCT's own connector asks when it
starts (`vllm_setup.py`); this plugin does it for every vLLM beside TraCT,
whatever its connector: vLLM's NixlConnector decode instance died so on such
a CPU (docs/VLLM.md, "Benchmark")."""
from __future__ import annotations

import logging

log = logging.getLogger("vllm.tract")


def request_amx_state() -> None:
    """Asks for the AMX tile state where the CPU has AMX; a no-op elsewhere.
    Never fails vLLM's start: what goes wrong is logged."""
    try:
        import torch
        init = getattr(torch.cpu, "_init_amx", None)
        if init is not None:
            init()
    except Exception as exc:        # a torch without it, a kernel that refuses
        log.warning("TraCT: asking Linux for the AMX tile state failed (%s); vLLM's CPU "
                    "attention may die of an illegal instruction on this CPU", exc)
