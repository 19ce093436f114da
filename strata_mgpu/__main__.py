from strata_mgpu.cli import main

main()
