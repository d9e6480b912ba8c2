# Sourced by the box scripts: stage the package as an import root (the box has no editable install) and export
# the environment every run uses. Sets STAGE and PYTHONPATH.
STAGE=${STAGE:-/tmp/pkg}; rm -rf "$STAGE"; mkdir -p "$STAGE"
cp -r hf_superoffload "$STAGE/"; cp -r triton_kernels "$STAGE/hf_superoffload/triton_kernels"
cp -r cpu_ext "$STAGE/hf_superoffload/cpu_ext"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$STAGE${PYTHONPATH:+:$PYTHONPATH}
