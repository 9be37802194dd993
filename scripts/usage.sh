# Sourced first by the scripts: -h or --help as the first argument prints the script's header
# comment (its usage) on stdout and exits 0.
case "${1:-}" in
    -h|--help) sed -e '1d' -e '/^[^#]/,$d' -e 's/^# \{0,1\}//' "$0"; exit 0 ;;
esac
