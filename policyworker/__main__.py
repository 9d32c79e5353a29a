from policyworker.cli import main

main()
