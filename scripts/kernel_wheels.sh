# The GPU kit's optional pure-Python packages on an offline GPU machine, carried in the working
# tree's .whl/ folder (git-ignored: name it in a device run's carry):
#   fla-core 0.6.0 (~1 MB, Triton kernels of the hybrid mixers; einops and triton come with
#   torch's images) and torchao 0.18.0 (~3 MB, the FP8 variant's float8 training; its compiled
#   extensions are optional, the float8 path is Python over torch._scaled_mm).
#
#   bash scripts/kernel_wheels.sh download   # where the registry is reachable: the wheels into .whl/
#   source scripts/kernel_wheels.sh          # on the GPU machine, first: installs each carried wheel
#                                            # whose package does not import, and puts it on PYTHONPATH
#
# Sourced, it uses $PYTHON (else python3) and installs into .whl/site; it changes nothing
# where a package already imports or no wheel was carried (it says which).
_kw_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_kw_py="${PYTHON:-python3}"
# module | requirement | wheel file prefix | what runs without it
_kw_list=("fla|fla-core==0.6.0|fla_core-|the gated delta rule runs in torch"
          "torchao|torchao==0.18.0|torchao-|the FP8 variant is left out")
for _kw_item in "${_kw_list[@]}"; do
    IFS='|' read -r _kw_mod _kw_req _kw_whl _kw_without <<<"$_kw_item"
    if [ "${1:-}" = "download" ]; then
        "$_kw_py" -m pip download -q --no-deps --only-binary=:all: -d "$_kw_repo/.whl" "$_kw_req" && \
            ls -l "$_kw_repo"/.whl/"$_kw_whl"*.whl
    elif "$_kw_py" -c "import $_kw_mod" 2>/dev/null; then
        echo "kernel_wheels: $_kw_req's package already imports" >&2
    elif ! compgen -G "$_kw_repo/.whl/$_kw_whl*.whl" >/dev/null; then
        echo "kernel_wheels: no $_kw_req wheel in .whl/ (bash scripts/kernel_wheels.sh download, then carry .whl):" \
             "$_kw_without" >&2
    else
        "$_kw_py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$_kw_repo/.whl/site" "$_kw_repo"/.whl/"$_kw_whl"*.whl && \
            case ":${PYTHONPATH:-}:" in *":$_kw_repo/.whl/site:"*) ;; *)
                export PYTHONPATH="$_kw_repo/.whl/site${PYTHONPATH:+:$PYTHONPATH}" ;; esac && \
            echo "kernel_wheels: $_kw_req from .whl/site" >&2
    fi
done
unset _kw_repo _kw_py _kw_list _kw_item _kw_mod _kw_req _kw_whl _kw_without
