# The hybrid mixers' GPU kernels on an offline GPU machine: fla-core 0.6.0 (a ~1 MB
# pure-Python wheel of Triton kernels; einops, its one dependency, and triton come with
# torch's images) carried in the working tree's .whl/ folder (git-ignored: name it in a
# device run's carry).
#
#   bash scripts/kernel_wheels.sh download   # where the registry is reachable: .whl/fla_core-0.6.0-py3-none-any.whl
#   source scripts/kernel_wheels.sh          # on the GPU machine, first: installs the carried wheel
#                                            # where fla does not import, and puts it on PYTHONPATH
#
# Sourced, it uses $PYTHON (else python3) and installs into .whl/site; it changes nothing
# where fla already imports or no wheel was carried (it says which).
_kw_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_kw_py="${PYTHON:-python3}"
if [ "${1:-}" = "download" ]; then
    "$_kw_py" -m pip download -q --no-deps --only-binary=:all: -d "$_kw_repo/.whl" "fla-core==0.6.0" && \
        ls -l "$_kw_repo"/.whl/fla_core-*.whl
elif "$_kw_py" -c "import fla" 2>/dev/null; then
    echo "kernel_wheels: fla-core already imports ($("$_kw_py" -c 'import fla; print(fla.__version__)'))" >&2
elif ! compgen -G "$_kw_repo/.whl/fla_core-*.whl" >/dev/null; then
    echo "kernel_wheels: no fla-core wheel in .whl/ (bash scripts/kernel_wheels.sh download, then carry .whl):" \
         "the gated delta rule runs in torch" >&2
else
    "$_kw_py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$_kw_repo/.whl/site" "$_kw_repo"/.whl/fla_core-*.whl && \
        export PYTHONPATH="$_kw_repo/.whl/site${PYTHONPATH:+:$PYTHONPATH}" && \
        echo "kernel_wheels: fla-core $("$_kw_py" -c 'import fla; print(fla.__version__)') from .whl/site" >&2
fi
unset _kw_repo _kw_py
