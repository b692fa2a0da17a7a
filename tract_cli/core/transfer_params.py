"""The names TraCT's vLLM connector and its front door (serve/vllm_proxy.py)
agree on in vLLM's per-request `kv_transfer_params` (docs/VLLM.md, "Topologies").

Here, in core, because two faces use them beside the connector (the front
door, serve/vllm_proxy.py, and the bench, bench/engine/calls.py) and faces
do not import the connector's modules, which import vLLM.
"""

# a P/D prefill's reply: the handoff's ticket (record, request id, blocks,
# tokens, and the region, model and page layout it was written for)
TICKET = "tract_ticket"
# a paired request: the name a front door gave both its prefill request and
# its decode request, which it sends at once; the prefill's handoff record is
# named by it, and the decode finds that record in the pool without the
# prefill's reply
PAIR = "tract_pair"
