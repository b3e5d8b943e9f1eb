from dagsync.cli import main

main()
