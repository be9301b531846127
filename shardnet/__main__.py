from shardnet.cli import main

main()
