from difftrain_rate.cli import main

main()
