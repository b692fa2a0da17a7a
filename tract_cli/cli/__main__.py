from tract_cli.cli import main

main()
