"""What a flow's command does around its flow: the Prefect server it starts for itself when none
is configured (:mod:`.local_server`), and what it prints when it stops (:mod:`.console`)."""
