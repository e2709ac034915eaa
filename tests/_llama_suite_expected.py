"""What llama.cpp's own server tests expect of bmoe-server (`test_llama_server_suite`).

`BASELINE_PASSED`: the cases llama-server itself passes on the model files the adapter
serves (`_llama_suite.make_hub`), measured with `_llama_suite_baseline.py` against
llama-server built from the pinned sdist's llama.cpp (0.5.0-dev, commit 0c1e570):
299 of the suite's 590 cases. The others assert what only their presets' own models
write (stories260K's words and token counts, a real reranker's ranking), or need files
nothing here can download (LoRA adapters, draft models, real models for tool calls);
llama-server fails them on these files too, so they say nothing about bmoe.

`EXCEPTIONS`: the baseline's cases bmoe-server does not pass, each with its reason: a
conflict with the security model or with the design (one model, one session, our own
web UI). `docs/api.md` lists them. A case that starts passing must leave the list.

`CI_FILES`: the suite's files CI runs (each case starts a server: the whole baseline
takes most of an hour on two cores), less `CI_LEAVES_OUT`; ``BMOE_LLAMA_SUITE=all`` runs
every file.
"""

from __future__ import annotations

BASELINE_PASSED: frozenset[str] = frozenset({
    'unit/test_basic.py::test_server_model_aliases_and_tags',
    'unit/test_basic.py::test_server_models',
    'unit/test_basic.py::test_server_multiple_addresses',
    'unit/test_basic.py::test_server_props',
    'unit/test_basic.py::test_server_slots',
    'unit/test_basic.py::test_server_start_simple',
    'unit/test_chat_completion.py::test_apply_chat_template',
    'unit/test_chat_completion.py::test_chat_completion_with_timings_per_token',
    'unit/test_chat_completion.py::test_chat_completions_multiple_choices',
    'unit/test_chat_completion.py::test_chat_completions_token_count',
    'unit/test_chat_completion.py::test_chat_template_assistant_prefill[Whill-Whill]',
    'unit/test_chat_completion.py::test_chat_template_assistant_prefill[prefill1-Wh\\n\\nill]',
    'unit/test_chat_completion.py::test_chat_template_continue_final_message_mutual_exclusion',
    'unit/test_chat_completion.py::test_chat_template_continue_final_message_vllm_compat',
    'unit/test_chat_completion.py::test_completion_with_grammar[False-root ::= "a"{5,5}-6-a{5,5}]',
    'unit/test_chat_completion.py::test_completion_with_grammar[True-root ::= "a"{5,5}-6-a{5,5}]',
    'unit/test_chat_completion.py::test_completion_with_invalid_grammar',
    'unit/test_chat_completion.py::test_completion_with_json_schema[False-json_schema0-6-"42"]',
    'unit/test_chat_completion.py::test_completion_with_response_format[response_format0-6-"42"]',
    'unit/test_chat_completion.py::test_completion_with_response_format[response_format1-10-[ -3000 ]]',
    'unit/test_chat_completion.py::test_completion_with_response_format[response_format2-10-"foooooo"]',
    'unit/test_chat_completion.py::test_completion_with_response_format[response_format3-10-(\\\\{|John)+]',
    'unit/test_chat_completion.py::test_completion_with_response_format[response_format4-0-None]',
    'unit/test_chat_completion.py::test_completion_with_response_format[response_format5-0-None]',
    'unit/test_chat_completion.py::test_completion_with_response_format[response_format6-0-None]',
    'unit/test_chat_completion.py::test_completion_with_response_format[response_format7-0-None]',
    'unit/test_chat_completion.py::test_context_size_exceeded',
    'unit/test_chat_completion.py::test_context_size_exceeded_stream',
    'unit/test_chat_completion.py::test_invalid_chat_completion_req[None]',
    'unit/test_chat_completion.py::test_invalid_chat_completion_req[messages2]',
    'unit/test_chat_completion.py::test_invalid_chat_completion_req[messages3]',
    'unit/test_chat_completion.py::test_invalid_chat_completion_req[messages4]',
    'unit/test_chat_completion.py::test_invalid_chat_completion_req[messages5]',
    'unit/test_chat_completion.py::test_invalid_chat_completion_req[messages6]',
    'unit/test_chat_completion.py::test_invalid_chat_completion_req[messages7]',
    'unit/test_chat_completion.py::test_invalid_chat_completion_req[string]',
    'unit/test_chat_completion.py::test_logit_bias',
    'unit/test_chat_completion.py::test_logprobs',
    'unit/test_chat_completion.py::test_logprobs_stream',
    'unit/test_chat_completion.py::test_return_progress[64-2-True]',
    'unit/test_chat_completion.py::test_verbose_debug',
    'unit/test_compat_anthropic.py::test_anthropic_count_tokens',
    'unit/test_compat_anthropic.py::test_anthropic_count_tokens_no_max_tokens',
    'unit/test_compat_anthropic.py::test_anthropic_count_tokens_with_system',
    'unit/test_compat_anthropic.py::test_anthropic_empty_messages',
    'unit/test_compat_anthropic.py::test_anthropic_messages_basic',
    'unit/test_compat_anthropic.py::test_anthropic_messages_conversation',
    'unit/test_compat_anthropic.py::test_anthropic_messages_multipart_content',
    'unit/test_compat_anthropic.py::test_anthropic_messages_streaming',
    'unit/test_compat_anthropic.py::test_anthropic_messages_with_system',
    'unit/test_compat_anthropic.py::test_anthropic_metadata',
    'unit/test_compat_anthropic.py::test_anthropic_missing_messages',
    'unit/test_compat_anthropic.py::test_anthropic_stop_sequences',
    'unit/test_compat_anthropic.py::test_anthropic_streaming_content_block_indices',
    'unit/test_compat_anthropic.py::test_anthropic_temperature',
    'unit/test_compat_anthropic.py::test_anthropic_thinking',
    'unit/test_compat_anthropic.py::test_anthropic_thinking_history_in_count_tokens',
    'unit/test_compat_anthropic.py::test_anthropic_thinking_history_in_template',
    'unit/test_compat_anthropic.py::test_anthropic_tool_result',
    'unit/test_compat_anthropic.py::test_anthropic_tool_result_error',
    'unit/test_compat_anthropic.py::test_anthropic_tool_result_with_image',
    'unit/test_compat_anthropic.py::test_anthropic_tool_result_with_text',
    'unit/test_compat_anthropic.py::test_anthropic_tool_streaming',
    'unit/test_compat_anthropic.py::test_anthropic_tool_use_basic',
    'unit/test_compat_anthropic.py::test_anthropic_top_k',
    'unit/test_compat_anthropic.py::test_anthropic_top_p',
    'unit/test_compat_anthropic.py::test_anthropic_vision_format_accepted',
    'unit/test_compat_anthropic.py::test_anthropic_vs_openai_different_response_format',
    'unit/test_compat_gcp.py::test_gcp_predict_camel_case',
    'unit/test_compat_gcp.py::test_gcp_predict_multiple_instances',
    'unit/test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry',
    'unit/test_completion.py::test_cancel_request',
    'unit/test_completion.py::test_completion_parallel_slots[1-3]',
    'unit/test_completion.py::test_completion_parallel_slots[2-2]',
    'unit/test_completion.py::test_completion_parallel_slots[2-4]',
    'unit/test_completion.py::test_completion_parallel_slots[4-2]',
    'unit/test_completion.py::test_completion_parallel_slots[4-6]',
    'unit/test_completion.py::test_completion_response_fields[I believe the meaning of life is-8-response_fields0]',
    'unit/test_completion.py::test_completion_stream_vs_non_stream',
    'unit/test_completion.py::test_completion_unified[256-4-n_predict_vals0-expected_success0]',
    'unit/test_completion.py::test_completion_unified[256-4-n_predict_vals1-expected_success1]',
    'unit/test_completion.py::test_completion_unified[256-4-n_predict_vals2-expected_success2]',
    'unit/test_completion.py::test_completion_unified[256-4-n_predict_vals3-expected_success3]',
    'unit/test_completion.py::test_completion_with_tokens_input',
    'unit/test_completion.py::test_consistent_result_different_batch_size[0.0-16]',
    'unit/test_completion.py::test_consistent_result_different_batch_size[0.0-32]',
    'unit/test_completion.py::test_consistent_result_same_seed[1]',
    'unit/test_completion.py::test_consistent_result_same_seed[2]',
    'unit/test_completion.py::test_different_result_different_seed[1]',
    'unit/test_completion.py::test_different_result_different_seed[2]',
    'unit/test_completion.py::test_json_prompt_mtm_error_when_not_supported',
    'unit/test_completion.py::test_json_prompt_no_mtmd',
    'unit/test_completion.py::test_logit_bias[False-False]',
    'unit/test_completion.py::test_logit_bias[False-True]',
    'unit/test_completion.py::test_logit_bias[True-False]',
    'unit/test_completion.py::test_logit_bias[True-True]',
    'unit/test_completion.py::test_n_probs',
    'unit/test_completion.py::test_n_probs_post_backend_sampling',
    'unit/test_completion.py::test_n_probs_post_sampling',
    'unit/test_completion.py::test_n_probs_stream',
    'unit/test_completion.py::test_nocache_long_input_prompt',
    'unit/test_ctx_shift.py::test_ctx_shift_disabled_long_prompt',
    'unit/test_ctx_shift.py::test_ctx_shift_disabled_short_prompt[64-64-False]',
    'unit/test_ctx_shift.py::test_ctx_shift_disabled_stream',
    'unit/test_embedding.py::test_embedding_content_text_same_as_string',
    'unit/test_embedding.py::test_embedding_error_prompt_too_long',
    'unit/test_embedding.py::test_embedding_invalid_input[input0]',
    'unit/test_embedding.py::test_embedding_invalid_input[input1]',
    'unit/test_embedding.py::test_embedding_invalid_input[input2]',
    'unit/test_embedding.py::test_embedding_invalid_input[input3]',
    'unit/test_embedding.py::test_embedding_invalid_input[input4]',
    'unit/test_embedding.py::test_embedding_invalid_input[input5]',
    'unit/test_embedding.py::test_embedding_mixed_input[-False]',
    'unit/test_embedding.py::test_embedding_mixed_input[input10-True]',
    'unit/test_embedding.py::test_embedding_mixed_input[input2-False]',
    'unit/test_embedding.py::test_embedding_mixed_input[input3-False]',
    'unit/test_embedding.py::test_embedding_mixed_input[input4-True]',
    'unit/test_embedding.py::test_embedding_mixed_input[input5-True]',
    'unit/test_embedding.py::test_embedding_mixed_input[input6-True]',
    'unit/test_embedding.py::test_embedding_mixed_input[input7-True]',
    'unit/test_embedding.py::test_embedding_mixed_input[input8-False]',
    'unit/test_embedding.py::test_embedding_mixed_input[input9-False]',
    'unit/test_embedding.py::test_embedding_mixed_input[string-False]',
    'unit/test_embedding.py::test_embedding_multiple',
    'unit/test_embedding.py::test_embedding_multiple_with_fa',
    'unit/test_embedding.py::test_embedding_openai_library_base64',
    'unit/test_embedding.py::test_embedding_openai_library_multiple',
    'unit/test_embedding.py::test_embedding_openai_library_single',
    'unit/test_embedding.py::test_embedding_pooling_mean',
    'unit/test_embedding.py::test_embedding_pooling_mean_multiple',
    'unit/test_embedding.py::test_embedding_pooling_none',
    'unit/test_embedding.py::test_embedding_pooling_none_oai',
    'unit/test_embedding.py::test_embedding_single',
    'unit/test_embedding.py::test_embedding_usage_multiple',
    'unit/test_embedding.py::test_embedding_usage_single[I believe the meaning of life is-9]',
    'unit/test_embedding.py::test_embedding_usage_single[This is a test-6]',
    'unit/test_embedding.py::test_same_prompt_give_same_result',
    'unit/test_ignore_eos.py::test_ignore_eos_false_no_logit_bias',
    'unit/test_ignore_eos.py::test_ignore_eos_populates_logit_bias',
    'unit/test_kv_keep_only_active.py::test_clear_and_restore',
    'unit/test_kv_keep_only_active.py::test_disabled_with_flag',
    'unit/test_mcp_servers.py::test_mcp_bad_command_does_not_crash',
    'unit/test_mcp_servers.py::test_mcp_concurrent_tool_calls',
    'unit/test_mcp_servers.py::test_mcp_config_file_errors',
    'unit/test_mcp_servers.py::test_mcp_empty_tool_list',
    'unit/test_mcp_servers.py::test_mcp_fail_once_eventual_success_verified',
    'unit/test_mcp_servers.py::test_mcp_fail_once_tool_eventual_success',
    'unit/test_mcp_servers.py::test_mcp_grandchild_holding_pipes_does_not_deadlock',
    'unit/test_mcp_servers.py::test_mcp_instance_respawn_after_crash',
    'unit/test_mcp_servers.py::test_mcp_multiple_servers',
    'unit/test_mcp_servers.py::test_mcp_notification_burst',
    'unit/test_mcp_servers.py::test_mcp_notification_during_request',
    'unit/test_mcp_servers.py::test_mcp_rapid_succession_calls',
    'unit/test_mcp_servers.py::test_mcp_slow_tool_call_slot_release',
    'unit/test_mcp_servers.py::test_mcp_tool_definition_shape_via_chat_completions',
    'unit/test_mcp_servers.py::test_mcp_tool_invocation',
    'unit/test_mcp_servers.py::test_mcp_tool_timeout',
    'unit/test_mcp_servers.py::test_mcp_tools_listed_in_tools_endpoint',
    'unit/test_mcp_servers.py::test_mcp_tools_not_listed_when_not_configured',
    'unit/test_mcp_servers.py::test_mcp_tools_slot_independent',
    'unit/test_mcp_servers.py::test_mcp_tools_via_json_config_file',
    'unit/test_mcp_servers.py::test_mcp_warmup_partial_failure',
    'unit/test_metrics.py::test_metrics_disabled',
    'unit/test_metrics.py::test_metrics_generation_rate_excludes_first_token',
    'unit/test_metrics.py::test_metrics_predicted_total_matches_requests',
    'unit/test_metrics.py::test_metrics_prometheus_format',
    'unit/test_metrics.py::test_metrics_prompt_processed_and_cached',
    'unit/test_metrics.py::test_metrics_slots_idle_after_completion',
    'unit/test_metrics.py::test_metrics_timings_are_finite[1]',
    'unit/test_metrics.py::test_metrics_timings_are_finite[8]',
    'unit/test_metrics.py::test_metrics_timings_on_prompt_progress',
    'unit/test_proxy.py::test_mcp_no_proxy',
    'unit/test_proxy.py::test_mcp_proxy_custom_port',
    'unit/test_proxy.py::test_mcp_proxy_no_content',
    'unit/test_rerank.py::test_invalid_rerank_req[123]',
    'unit/test_rerank.py::test_invalid_rerank_req[None]',
    'unit/test_rerank.py::test_invalid_rerank_req[documents0]',
    'unit/test_rerank.py::test_invalid_rerank_req[documents3]',
    'unit/test_rerank.py::test_rerank_tei_top_n[2-2]',
    'unit/test_rerank.py::test_rerank_tei_top_n[4-4]',
    'unit/test_rerank.py::test_rerank_tei_top_n[99-4]',
    'unit/test_rerank.py::test_rerank_tei_top_n[None-4]',
    'unit/test_rerank.py::test_rerank_top_n[2-2]',
    'unit/test_rerank.py::test_rerank_top_n[4-4]',
    'unit/test_rerank.py::test_rerank_top_n[99-4]',
    'unit/test_rerank.py::test_rerank_top_n[None-4]',
    'unit/test_router.py::test_router_chat_completion_stream[non-existent/model-False]',
    'unit/test_router.py::test_router_delete_model',
    'unit/test_router.py::test_router_props',
    'unit/test_router.py::test_router_reload_models',
    'unit/test_security.py::test_access_public_endpoint[/health]',
    'unit/test_security.py::test_correct_api_key',
    'unit/test_security.py::test_correct_api_key_anthropic_header',
    'unit/test_security.py::test_cors_options[localhost-Access-Control-Allow-Origin-localhost]',
    'unit/test_security.py::test_cors_options[origin-Access-Control-Allow-Credentials-true]',
    'unit/test_security.py::test_cors_options[web.mydomain.fr-Access-Control-Allow-Headers-*]',
    'unit/test_security.py::test_cors_options[web.mydomain.fr-Access-Control-Allow-Methods-GET, POST, DELETE, OPTIONS]',
    'unit/test_security.py::test_cors_options[web.mydomain.fr-Access-Control-Allow-Origin-web.mydomain.fr]',
    'unit/test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled',
    'unit/test_security.py::test_cors_origins_localhost_reflects[http://127.0.0.1:3000]',
    'unit/test_security.py::test_cors_origins_localhost_reflects[http://127.0.0.1]',
    'unit/test_security.py::test_cors_origins_localhost_reflects[http://[::1]:3000]',
    'unit/test_security.py::test_cors_origins_localhost_reflects[http://[::1]]',
    'unit/test_security.py::test_cors_origins_localhost_reflects[http://localhost:8080]',
    'unit/test_security.py::test_cors_origins_localhost_reflects[http://localhost]',
    'unit/test_security.py::test_cors_origins_localhost_rejects[http://evil.com]',
    'unit/test_security.py::test_cors_origins_localhost_rejects[http://localhost.evil.com]',
    'unit/test_security.py::test_cors_origins_localhost_rejects[http://notlocalhost]',
    'unit/test_security.py::test_cors_origins_localhost_rejects[http://web.mydomain.fr]',
    'unit/test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers',
    'unit/test_security.py::test_incorrect_api_key[None]',
    'unit/test_security.py::test_incorrect_api_key[invalid-key]',
    'unit/test_security.py::test_local_media_file[../../../tools-file://../mtmd/test-1.jpeg-False]',
    'unit/test_security.py::test_local_media_file[../../../tools-file://mtmd/notfound.jpeg-False]',
    'unit/test_security.py::test_local_media_file[None-file://mtmd/test-1.jpeg-False]',
    'unit/test_security.py::test_openai_library_correct_api_key',
    'unit/test_sleep.py::test_server_sleep',
    'unit/test_sleep.py::test_server_sleep_metrics_buckets',
    'unit/test_sleep.py::test_server_sleep_read_only_endpoints',
    'unit/test_sleep.py::test_server_sleep_token_counting_wake',
    'unit/test_slot_save.py::test_slot_save_restore_text_only_on_multimodal',
    'unit/test_template.py::test_add_generation_prompt[meta-llama-Llama-3.3-70B-Instruct-<|start_header_id|>assistant<|end_header_id|>-False]',  # noqa: E501
    'unit/test_template.py::test_add_generation_prompt[meta-llama-Llama-3.3-70B-Instruct-<|start_header_id|>assistant<|end_header_id|>-True]',  # noqa: E501
    'unit/test_template.py::test_date_inside_prompt[fireworks-ai-llama-3-firefunction-v2-%b %d %Y-None]',
    'unit/test_template.py::test_date_inside_prompt[fireworks-ai-llama-3-firefunction-v2-%b %d %Y-tools1]',
    'unit/test_template.py::test_date_inside_prompt[fireworks-ai-llama-3-firefunction-v2-%b %d %Y-tools2]',
    'unit/test_template.py::test_date_inside_prompt[meta-llama-Llama-3.3-70B-Instruct-%d %b %Y-None]',
    'unit/test_template.py::test_date_inside_prompt[meta-llama-Llama-3.3-70B-Instruct-%d %b %Y-tools1]',
    'unit/test_template.py::test_date_inside_prompt[meta-llama-Llama-3.3-70B-Instruct-%d %b %Y-tools2]',
    'unit/test_template.py::test_reasoning[CohereForAI-c4ai-command-r7b-12-2024-tool_use-auto-<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>-None]',  # noqa: E501
    'unit/test_template.py::test_reasoning[CohereForAI-c4ai-command-r7b-12-2024-tool_use-auto-<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>-tools1]',  # noqa: E501
    'unit/test_template.py::test_reasoning[CohereForAI-c4ai-command-r7b-12-2024-tool_use-auto-<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>-tools2]',  # noqa: E501
    'unit/test_template.py::test_reasoning[CohereForAI-c4ai-command-r7b-12-2024-tool_use-off-<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>-None]',  # noqa: E501
    'unit/test_template.py::test_reasoning[CohereForAI-c4ai-command-r7b-12-2024-tool_use-off-<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>-tools1]',  # noqa: E501
    'unit/test_template.py::test_reasoning[CohereForAI-c4ai-command-r7b-12-2024-tool_use-off-<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>-tools2]',  # noqa: E501
    'unit/test_template.py::test_reasoning[Qwen-QwQ-32B-auto-<|im_start|>assistant\\n<think>\\n-None]',
    'unit/test_template.py::test_reasoning[Qwen-QwQ-32B-auto-<|im_start|>assistant\\n<think>\\n-tools1]',
    'unit/test_template.py::test_reasoning[Qwen-QwQ-32B-auto-<|im_start|>assistant\\n<think>\\n-tools2]',
    'unit/test_template.py::test_reasoning[Qwen-QwQ-32B-off-<|im_start|>assistant\\n<think>\\n</think>-None]',
    'unit/test_template.py::test_reasoning[Qwen-QwQ-32B-off-<|im_start|>assistant\\n<think>\\n</think>-tools1]',
    'unit/test_template.py::test_reasoning[Qwen-QwQ-32B-off-<|im_start|>assistant\\n<think>\\n</think>-tools2]',
    'unit/test_template.py::test_reasoning[Qwen-Qwen3-0.6B-auto-<|im_start|>assistant\\n-None]',
    'unit/test_template.py::test_reasoning[Qwen-Qwen3-0.6B-auto-<|im_start|>assistant\\n-tools1]',
    'unit/test_template.py::test_reasoning[Qwen-Qwen3-0.6B-auto-<|im_start|>assistant\\n-tools2]',
    'unit/test_template.py::test_reasoning[Qwen-Qwen3-0.6B-off-<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n-None]',  # noqa: E501
    'unit/test_template.py::test_reasoning[Qwen-Qwen3-0.6B-off-<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n-tools1]',  # noqa: E501
    'unit/test_template.py::test_reasoning[Qwen-Qwen3-0.6B-off-<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n-tools2]',  # noqa: E501
    'unit/test_template.py::test_reasoning[deepseek-ai-DeepSeek-R1-Distill-Qwen-32B-auto-<think>\\n-None]',
    'unit/test_template.py::test_reasoning[deepseek-ai-DeepSeek-R1-Distill-Qwen-32B-auto-<think>\\n-tools1]',
    'unit/test_template.py::test_reasoning[deepseek-ai-DeepSeek-R1-Distill-Qwen-32B-auto-<think>\\n-tools2]',
    'unit/test_template.py::test_reasoning[deepseek-ai-DeepSeek-R1-Distill-Qwen-32B-off-<think>\\n</think>-None]',
    'unit/test_template.py::test_reasoning[deepseek-ai-DeepSeek-R1-Distill-Qwen-32B-off-<think>\\n</think>-tools1]',
    'unit/test_template.py::test_reasoning[deepseek-ai-DeepSeek-R1-Distill-Qwen-32B-off-<think>\\n</think>-tools2]',
    'unit/test_template.py::test_reasoning[deepseek-ai-DeepSeek-R1-Distill-Qwen-32B-on-<think>\\n-None]',
    'unit/test_template.py::test_reasoning[deepseek-ai-DeepSeek-R1-Distill-Qwen-32B-on-<think>\\n-tools1]',
    'unit/test_template.py::test_reasoning[deepseek-ai-DeepSeek-R1-Distill-Qwen-32B-on-<think>\\n-tools2]',
    'unit/test_tokenize.py::test_tokenize_detokenize',
    'unit/test_tokenize.py::test_tokenize_with_pieces',
    'unit/test_tool_call.py::test_completion_without_tool_call_fast[meta-llama-Llama-3.3-70B-Instruct-128-tools0-None-CompletionMode.NORMAL]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_fast[meta-llama-Llama-3.3-70B-Instruct-128-tools0-None-CompletionMode.STREAMED]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_fast[meta-llama-Llama-3.3-70B-Instruct-128-tools2-none-CompletionMode.NORMAL]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_fast[meta-llama-Llama-3.3-70B-Instruct-128-tools2-none-CompletionMode.STREAMED]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_slow[meetkai-functionary-medium-v3.1-256-tools3-None-CompletionMode.NORMAL]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_slow[meetkai-functionary-medium-v3.1-256-tools3-None-CompletionMode.STREAMED]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_slow[meetkai-functionary-medium-v3.1-256-tools4-None-CompletionMode.NORMAL]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_slow[meetkai-functionary-medium-v3.1-256-tools4-None-CompletionMode.STREAMED]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_slow[meetkai-functionary-medium-v3.1-256-tools5-none-CompletionMode.NORMAL]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_slow[meetkai-functionary-medium-v3.1-256-tools5-none-CompletionMode.STREAMED]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_slow[meta-llama-Llama-3.2-3B-Instruct-256-tools6-None-CompletionMode.NORMAL]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_slow[meta-llama-Llama-3.2-3B-Instruct-256-tools6-None-CompletionMode.STREAMED]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_slow[meta-llama-Llama-3.2-3B-Instruct-256-tools8-none-CompletionMode.NORMAL]',  # noqa: E501
    'unit/test_tool_call.py::test_completion_without_tool_call_slow[meta-llama-Llama-3.2-3B-Instruct-256-tools8-none-CompletionMode.STREAMED]',  # noqa: E501
    'unit/test_tools_builtin.py::test_tools_builtin_cwd_header',
    'unit/test_tools_builtin.py::test_tools_builtin_cwd_header_overrides_model_param',
    'unit/test_tools_builtin.py::test_tools_builtin_cwd_relative_paths',
    'unit/test_tools_builtin.py::test_tools_builtin_edit_file_rejects_non_unique_old_text',
    'unit/test_tools_builtin.py::test_tools_builtin_edit_file_rejects_overlapping_edits',
    'unit/test_tools_builtin.py::test_tools_builtin_exec_shell_command_stream',
    'unit/test_tools_builtin.py::test_tools_builtin_file_glob_search_junk_dirs',
    'unit/test_tools_builtin.py::test_tools_builtin_file_glob_search_max_depth_and_limit',
    'unit/test_tools_builtin.py::test_tools_builtin_file_glob_search_rejects_invalid_type',
    'unit/test_tools_builtin.py::test_tools_builtin_file_glob_search_type_dir',
    'unit/test_tools_builtin.py::test_tools_builtin_grep_search',
    'unit/test_tools_builtin.py::test_tools_builtin_read_file',
    'unit/test_tools_builtin.py::test_tools_builtin_runtime_header_rejects_container_option_injection[docker]',
    'unit/test_tools_builtin.py::test_tools_builtin_runtime_header_rejects_container_option_injection[podman]',
    'unit/test_tools_builtin.py::test_tools_builtin_runtime_header_rejects_ssh_option_injection',
    'unit/test_tools_builtin.py::test_tools_builtin_runtime_header_unknown_scheme',
    'unit/test_tools_builtin.py::test_tools_builtin_write_then_edit_file',
    'unit/test_vision_api.py::test_models_supports_multimodal_capability',
    'unit/test_vision_api.py::test_v1_models_supports_multimodal_capability',
    'unit/test_vision_api.py::test_vision_chat_completion[What is this:\\n-data:text/html;base64,aGVsbG8=-False-None]',
    'unit/test_vision_api.py::test_vision_chat_completion[What is this:\\n-https://ggml.ai-False-None]',
    'unit/test_vision_api.py::test_vision_chat_completion[What is this:\\n-https://google.com/404-False-None]',
    'unit/test_vision_api.py::test_vision_chat_completion[What is this:\\n-malformed-False-None]',
    'unit/test_vision_api.py::test_vision_completion[What is this: <__media__>\\n-malformed-False-None]',
    'unit/test_vision_api.py::test_vision_completion[What is this:\\n--False-None]',
    'unit/test_vision_api.py::test_vision_embeddings[What is this: <__media__>\\n-malformed-False]',
    'unit/test_vision_api.py::test_vision_embeddings[What is this:\\n-base64-False]',
})

ROUTER_PRESET = "It starts llama-server's router preset"
_NO_MODEL = (
    "It starts llama-server's router preset, a server with no model, and waits for "
    '/health to answer 200; bmoe-server with no model answers 503 no_model (as llama-'
    'server does while its one model is not ready), so the case fails at its start. ')
_BUILTIN_TOOLS = _NO_MODEL + (
    "What it tests is llama-server's /tools route: file reads, writes and edits, "
    "searches and shell commands at any path a request names; bmoe's file tools "
    'resolve every path inside a workspace the person added and its commands run '
    'there, from a conversation on loopback (the security model).')
_CORS_ORIGINS = _NO_MODEL + (
    'What it tests is --cors-origins localhost allowing pages of any localhost port '
    'by CORS headers; bmoe-server sends no CORS header, and another port on this host'
    ' is exactly where a hostile local page is served from (the security model; '
    '--cors-origins names origins as --allow-origin does).')
_CORS_PREFLIGHT = (
    'It sends a CORS preflight from a foreign origin and expects that origin allowed '
    'in Access-Control-Allow-* headers; bmoe-server sends no CORS header and refuses '
    'a browser request from any page but its own (403; 401 first without the key): '
    'the security model.')
_MCP_TOOLS = _NO_MODEL + (
    "What it tests is llama-server's /tools route running the MCP servers of --mcp-"
    "servers-json for any request, for its web UI's agent loop; bmoe's MCP servers "
    "are its agent's, called inside a conversation, from loopback and under the "
    "person's approvals, and no route runs a tool a request names (the security "
    'model).')
_PROXY = (
    'With --ui-mcp-proxy llama-server fetches any URL a request names through /cors-'
    'proxy for its web UI; bmoe-server fetches no address a request names (a request '
    'forgery the security model does not open): /cors-proxy is always 403.')
_ROUTER = _NO_MODEL + (
    'What it tests is router mode: several models, each in a server process of its '
    'own (--models-max, --models-preset, loads and deletes through /models); bmoe-'
    'server serves one model in one session (the design).')

def _cases(prefix: str, reason: str) -> dict[str, str]:
    return {c: reason for c in BASELINE_PASSED if c.startswith(prefix)}


EXCEPTIONS: dict[str, str] = {
    "unit/test_kv_keep_only_active.py::test_clear_and_restore":
        "It reads llama-server's own debug log for its __TEST_TAG_ markers of idle-slot "
        "caching; bmoe-server's log is its own, and its one KV sequence has no idle slot "
        "to park.",
    "unit/test_compat_anthropic.py::test_anthropic_tool_result_with_image":
        "It expects a 500 for an image sent to a model loaded without a projector; "
        "bmoe-server answers 400 no_vision (an invalid_request_error on /v1/messages): the "
        "request is what is wrong, and only the server's own faults are 500s.",
    "unit/test_compat_anthropic.py::test_anthropic_vision_format_accepted":
        "It expects a 500 for an image sent to a model loaded without a projector; "
        "bmoe-server answers 400 no_vision (an invalid_request_error on /v1/messages): the "
        "request is what is wrong, and only the server's own faults are 500s.",
    "unit/test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry":
        "Its answer is cut at max_output_tokens and it waits for response.completed; "
        "bmoe-server ends a cut answer with response.incomplete (status incomplete, "
        "incomplete_details max_output_tokens), as OpenAI's Responses API and Codex read "
        "it. Its progress and per-token timings checks pass before that.",
    **_cases("unit/test_mcp_servers.py::", _MCP_TOOLS),
    **_cases("unit/test_tools_builtin.py::", _BUILTIN_TOOLS),
    **_cases("unit/test_router.py::", _ROUTER),
    **_cases("unit/test_proxy.py::test_mcp_proxy_", _PROXY),
    **_cases("unit/test_security.py::test_cors_options[", _CORS_PREFLIGHT),
    **_cases("unit/test_security.py::test_cors_origins_", _CORS_ORIGINS),
    **_cases("unit/test_security.py::test_cors_proxy_", _PROXY),
}

CI_FILES: tuple[str, ...] = (
    "unit/test_basic.py",
    "unit/test_tokenize.py",
    "unit/test_metrics.py",
    "unit/test_completion.py",
    "unit/test_ctx_shift.py",
    "unit/test_ignore_eos.py",
    "unit/test_kv_keep_only_active.py",
    "unit/test_compat_gcp.py",
    "unit/test_embedding.py",
    "unit/test_rerank.py",
    "unit/test_chat_completion.py",
    "unit/test_template.py",
    "unit/test_compat_anthropic.py",
    "unit/test_compat_oai_responses.py",
    "unit/test_tool_call.py",
    "unit/test_vision_api.py",
    "unit/test_sleep.py",
    "unit/test_slot_save.py",
    "unit/test_security.py",
    "unit/test_proxy.py",
)

# Exceptions CI does not run although their file is in CI_FILES: each starts a server with
# no model (the router preset) and so waits the harness's 60 s for a /health 200 that does
# not come. ``BMOE_LLAMA_SUITE=all`` runs them, and they must still fail there.
CI_LEAVES_OUT: frozenset[str] = frozenset(
    c for c, why in EXCEPTIONS.items()
    if c.split("::")[0] in CI_FILES and why.startswith(ROUTER_PRESET))
