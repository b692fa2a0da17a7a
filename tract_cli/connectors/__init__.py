"""Engine integrations: faces beside `serve/` that an engine imports.

`connectors.vllm.TractConnector` is vLLM's KV connector (loaded by vLLM
through `kv_connector_module_path`); it needs vLLM, which importing
`tract_cli` never does.  `paged` (layout conversion) and `settings` (the
connector's configuration) need no engine.
"""
