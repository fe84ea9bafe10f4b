from distdoctor.cli import main

main()
