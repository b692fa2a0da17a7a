"""TraCT's vLLM general plugin: entry point `tract_amx` of the group
`vllm.general_plugins`, which vLLM calls at start in each of its processes (its
front end, its engine core, its workers) of an environment where TraCT is
installed; `VLLM_PLUGINS` selects which plugins vLLM loads.

It asks Linux for the AMX tile state on a CPU that has AMX.  vLLM 0.32's CPU
attention runs AMX instructions for bf16 without asking; a decode instance
whose first step attends over KV it loaded, computing a single token, died of
an illegal instruction in it (where a prompt computed whole did not: perhaps
torch's oneDNN asks first there, when its products use AMX; not verified).
TraCT's own connector asks when it
starts (`vllm_setup.py`); this plugin does it for every vLLM beside TraCT,
whatever its connector: vLLM's NixlConnector decode instance died so on such
a CPU (docs/VLLM.md, "Benchmark")."""
from __future__ import annotations

import logging

log = logging.getLogger("vllm.tract")


def request_amx_state() -> bool | None:
    """Asks for the AMX tile state where the CPU has AMX (what vLLM's attention
    checks before it picks its AMX path); a no-op elsewhere.  Returns whether
    the state was granted, None where there was nothing to ask (no AMX, or a
    torch without these calls).  Never fails vLLM's start: a refusal (an old
    kernel; a signal stack too small for the AMX state) is logged."""
    try:
        import torch
        supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
        init = getattr(torch.cpu, "_init_amx", None)
        if supported is None or init is None or not supported():
            return None
        if init():
            return True
        why = "Linux refused it"
    except Exception as exc:        # a torch that fails the call itself
        why = str(exc)
    log.warning("TraCT: asking Linux for the AMX tile state failed (%s); vLLM's CPU "
                "attention may die of an illegal instruction on this CPU", why)
    return False
