# Installs flash-attn-4 on the GPU machine once its three parts are in /tmp/fa4 (stash-fa4.sh
# after each carry): joins the CUDA-13 library wheel, checks its SHA-256, installs the wheels
# into /tmp/site (beside flashinfer, scripts/gpu/setup.sh) and the DSL's requirements the
# image lacks, and puts the DSL's packages on PYTHONPATH (it reaches ``cutlass`` through a .pth
# file, which a --target folder on PYTHONPATH never reads). Source it after setup.sh:
#
#     . scripts/gpu/setup.sh && . scripts/gpu/install-fa4.sh
_fa4_install() {
    if [ ! -d /tmp/site/flash_attn ]; then
        ( cd /tmp/fa4 && cat cu13.p0 cu13.p1 cu13.p2 > "$(cut -d' ' -f3 cu13.sha)" \
            && sha256sum -c cu13.sha ) || return 1
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
            /tmp/fa4/*.whl || return 1
        local missing=()
        python3 -c "import cuda.bindings" 2>/dev/null || missing+=(/tmp/fa4/deps/cuda_*.whl)
        python3 -c "import google.protobuf" 2>/dev/null || missing+=(/tmp/fa4/deps/protobuf-*.whl)
        if [ "${#missing[@]}" -gt 0 ]; then
            echo "install-fa4: the image lacks ${missing[*]##*/}: installing them"
            python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
                "${missing[@]}" || return 1
        fi
    fi
    case ":$PYTHONPATH:" in
        *":/tmp/site/nvidia_cutlass_dsl/dsl_packages:"*) ;;
        *) export PYTHONPATH="$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages" ;;
    esac
    python3 -c "import flash_attn.cute, importlib.metadata as m; print('install-fa4: flash_attn.cute imports, flash-attn-4', m.version('flash-attn-4'))"
}
_fa4_install
_fa4_status=$?
unset -f _fa4_install
[ "$_fa4_status" = 0 ] || echo "install-fa4: FAILED (see above)" >&2
[ "$_fa4_status" = 0 ]
