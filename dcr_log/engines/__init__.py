"""Integrations with serving engines: receivers that apply a log's versions in place into a
running engine, through the engine's own load pipeline (spec/RECEIVER.md section 12).

- ``dcr_log.engines.vllm``: vLLM (offline ``LLM`` and worker extensions for servers and RL
  frameworks that drive vLLM through ``collective_rpc``).
"""
