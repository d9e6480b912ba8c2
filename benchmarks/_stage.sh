# Sourced by the box scripts: stage the package as an import root (the box has no editable install) and export
# the environment every run uses. Sets STAGE and PYTHONPATH.
STAGE=${STAGE:-/tmp/pkg}; rm -rf "$STAGE"; mkdir -p "$STAGE"
cp -r hf_superoffload "$STAGE/"; cp -r triton_kernels "$STAGE/hf_superoffload/triton_kernels"
cp -r cpu_ext "$STAGE/hf_superoffload/cpu_ext"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$STAGE${PYTHONPATH:+:$PYTHONPATH}

# Pack everything under $OUT into $OUT/all_<script>.tgz, leaving only the archives and the named files beside them: a
# device call brings back at most 8 files (a 2026-11-30 call lost a suite's JSONL lines to that limit). Scripts chained in one
# call each leave their own archive. PACK=0 leaves $OUT as is.
pack_out() {
  [ "${PACK:-1}" = 1 ] || return 0
  local name args=() k
  name="all_$(basename "$0" .sh).tgz"
  ( cd "$OUT" && tar czf /tmp/_pack_out.tgz --exclude='./all_*.tgz' . ) && mv /tmp/_pack_out.tgz "$OUT/$name" || return 0
  args=(! -name 'all_*.tgz')
  for k in "$@"; do args+=(! -name "$k"); done
  find "$OUT" -mindepth 1 -maxdepth 1 "${args[@]}" -exec rm -rf {} +
  echo "packed \$OUT into $name (kept: $*)"
}
