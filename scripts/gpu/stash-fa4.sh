# Keeps the flash-attn-4 part this call carried (.fa4a, .fa4b or .fa4c) outside the checkout,
# in /tmp/fa4, where the next call of the same warm machine finds it (its checkout replaces
# the carried folders). Source or run it from the repository root on the GPU machine.
mkdir -p /tmp/fa4/deps
for _fa4_part in .fa4a .fa4b .fa4c; do
    [ -d "$_fa4_part" ] && cp -r "$_fa4_part"/. /tmp/fa4/
done
ls /tmp/fa4
unset _fa4_part
