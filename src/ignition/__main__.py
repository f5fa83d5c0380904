from flare.cli.ignition import main

raise SystemExit(main())
